"""What a bench runs: random weights for a config (no checkpoint file), or a checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SYNTHETIC_SIZES = ("35b", "tiny")
RANDOM_WEIGHTS_NOTE = ("synthetic weights (random 4-bit codes): routing with a random router is close to uniform, "
                       "so expert traffic is not that of a trained model")


@dataclass(frozen=True)
class Target:
    config_path: Path  # config.json (for random weights: where save() writes the text_config)
    checkpoint: Path | None  # None: random weights generated in memory from the config
    label: str
    synthetic_config: dict | None = None  # random weights: the config, until save() writes it

    @property
    def random_weights(self) -> bool:
        return self.checkpoint is None

    def config(self) -> dict:
        if self.synthetic_config is not None:
            return json.loads(json.dumps(self.synthetic_config))  # a copy
        return json.loads(self.config_path.read_text())

    def save(self) -> None:
        """Writes a synthetic config where the arms read it (nothing for a checkpoint)."""
        if self.synthetic_config is not None:
            self.config_path.write_text(json.dumps(self.synthetic_config, indent=1) + "\n")

    def text_config(self) -> dict:
        """The text model's fields, with the top-level ones a text_config may leave out."""
        c = self.config()
        text = dict(c.get("text_config", c))
        text.setdefault("tie_word_embeddings", c.get("tie_word_embeddings", False))
        return text

    def arm_args(self) -> list[str]:
        if self.checkpoint is None:
            return ["--config", str(self.config_path), "--label", self.label]
        return ["--model", str(self.checkpoint), "--label", self.label]

    @classmethod
    def from_arm_args(cls, config: str | None, model: str | None, label: str) -> "Target":
        if model:
            return cls(Path(model) / "config.json", Path(model), label)
        return cls(Path(config), None, label)

    def describe(self, results_dir: Path) -> dict:
        if self.checkpoint is None:
            return {"label": self.label, "weights": "random", "config": within(self.config_path, results_dir),
                    "note": RANDOM_WEIGHTS_NOTE}
        return {"label": self.label, "weights": "checkpoint", "path": within(self.checkpoint, results_dir)}


def within(path: str | Path, results_dir: Path) -> str:
    """`path` relative to the results directory when it lies there ("." for the directory
    itself), else as given: results stay true when their directory is moved or committed."""
    resolved, base = Path(path).resolve(), results_dir.resolve()
    if resolved == base or base in resolved.parents:
        return resolved.relative_to(base).as_posix()
    return str(path)


def prepare(synthetic_size: str | None, model: str | None, work_dir: Path) -> Target:
    """The target of a sweep, checked and resolved without writing anything; a synthetic
    config goes into work_dir when Target.save() is called."""
    if synthetic_size:
        from .. import synthetic

        if synthetic_size not in SYNTHETIC_SIZES:
            raise ValueError(f"--synthetic must be one of {', '.join(SYNTHETIC_SIZES)}, got '{synthetic_size}'")
        config = synthetic.config_35b() if synthetic_size == "35b" else synthetic.tiny_config()
        return Target(work_dir / f"config-{synthetic_size}.json", None, f"synthetic {synthetic_size}", config)
    from .. import hub

    directory = hub.resolve(model)
    return Target(directory / "config.json", directory, str(model))
