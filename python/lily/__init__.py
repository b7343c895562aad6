"""lily: fast local inference for the Qwen3.5/3.6 hybrid mixture-of-experts models.

    import lily
    model = lily.Model.load("path/to/Qwen3.6-35B-A3B-4bit")
    print(model.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=64).text)
"""

from ._lily import STREAM_READ_AHEAD, LilyError
from ._version import __version__
from .model import GenerationResult, Model, Piece, Session
from .params import LilyWarning

__all__ = ["Model", "Session", "GenerationResult", "Piece", "LilyError", "LilyWarning", "STREAM_READ_AHEAD",
           "__version__"]
