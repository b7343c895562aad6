"""`lily chat`: turns stream through one session, later turns reuse the cached history,
/reset and /system, thinking shown or hidden, Ctrl-C at the prompt and during a reply, and a
conversation that outgrows the context (/trim)."""

from __future__ import annotations

import io

from lily.chat_cli import Chat, run
from lily.cli import build_parser
from lily.tool_calls import parse_assistant_output


def parse(tiny_mlx_dir, *flags):
    return build_parser().parse_args(["chat", "-m", str(tiny_mlx_dir), "--device", "cpu", "-n", "12", *flags])


def chat_session(tiny_model, tiny_mlx_dir, *flags):
    out, err = io.StringIO(), io.StringIO()
    return Chat(tiny_model, parse(tiny_mlx_dir, *flags), out, err), out, err


def feed(chat, *lines):
    """Types each line at the prompt (an exception instead: raised there, as Ctrl-C is), then Ctrl-D."""
    it = iter(lines)

    def read_line():
        line = next(it, EOFError())
        if isinstance(line, BaseException):
            raise line
        return line

    chat.loop(read_line)


def stats(err) -> list[tuple[int, int]]:
    """(new, cached) prefill tokens of each turn, from the status lines."""
    out = []
    for line in err.getvalue().splitlines():
        if line.startswith("[prefill "):
            words = line.split()
            out.append((int(words[1]), int(words[4])))
    return out


def expected_reply(model, messages, **kwargs):
    r = model.generate(messages=messages, max_tokens=12, temperature=0, **kwargs)
    text = r.text
    for i in model.eos_token_ids:
        text = text.removesuffix(model.decode([i]))
    return text


def test_chat_is_registered():
    args = build_parser().parse_args(["chat", "--no-think", "--hide-thinking"])
    assert args.func is run and args.think is False and args.hide_thinking


def test_second_turn_feeds_only_the_new_turn(tiny_model, tiny_mlx_dir):
    chat, out, err = chat_session(tiny_model, tiny_mlx_dir, "--no-think")
    feed(chat, "Name a colour.", "Another one?")
    (new1, cached1), (new2, cached2) = stats(err)
    first = [{"role": "user", "content": "Name a colour."}]
    history = tiny_model.encode(tiny_model.apply_chat_template(first, add_generation_prompt=False)
                                + "<|im_start|>assistant\n")
    assert cached1 == 0 and new1 == len(tiny_model.prompt_ids(messages=first, enable_thinking=False))
    assert cached2 == len(history)
    assert new2 + cached2 == len(tiny_model.prompt_ids(messages=chat.messages[:3], enable_thinking=False))
    reply = parse_assistant_output(expected_reply(tiny_model, first, enable_thinking=False)).content
    assert chat.messages[1] == {"role": "assistant", "content": reply}
    assert out.getvalue().startswith(reply)


def test_reset_and_system(tiny_model, tiny_mlx_dir):
    chat, out, err = chat_session(tiny_model, tiny_mlx_dir, "--no-think")
    feed(chat, "Hi", "/reset", "Hi", "/system Be brief.", "Hi")
    (new1, cached1), (new2, cached2), (new3, cached3) = stats(err)
    assert (new2, cached2) == (0, new1)  # the same first turn again: all from cache
    assert cached3 == 0 and new3 > new1  # the system prompt comes first: nothing shared
    assert chat.messages[0] == {"role": "user", "content": "Hi"} and len(chat.messages) == 2
    assert chat.system == "Be brief."
    assert "conversation reset" in err.getvalue()


def test_thinking_is_shown_or_hidden(tiny_model, tiny_mlx_dir):
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    want = parse_assistant_output(expected_reply(tiny_model, messages), in_reasoning=True)
    assert want.reasoning, "the greedy reply should start with some thinking"
    shown, out, _ = chat_session(tiny_model, tiny_mlx_dir)
    feed(shown, "Why is the sky blue?")
    assert out.getvalue().startswith(want.reasoning)
    hidden, out, _ = chat_session(tiny_model, tiny_mlx_dir, "--hide-thinking")
    feed(hidden, "Why is the sky blue?")
    assert want.reasoning not in out.getvalue()
    assert hidden.messages[-1]["content"] == want.content  # the history keeps the answer only


def test_unknown_command_prints_help(tiny_model, tiny_mlx_dir):
    chat, _, err = chat_session(tiny_model, tiny_mlx_dir)
    feed(chat, "/what", "/exit", "never read")
    assert "/reset" in err.getvalue() and chat.messages == []


def test_ctrl_c_at_the_prompt_clears_the_line_and_a_second_one_leaves(tiny_model, tiny_mlx_dir):
    chat, _, err = chat_session(tiny_model, tiny_mlx_dir, "--no-think")
    feed(chat, "Hi", KeyboardInterrupt(), "Hi again", KeyboardInterrupt(), KeyboardInterrupt(), "never read")
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["Hi", "Hi again"]
    assert err.getvalue().count("[Ctrl-C again or Ctrl-D to leave]") == 2


def test_ctrl_c_during_a_reply_stops_it_and_keeps_the_conversation(tiny_model, tiny_mlx_dir, monkeypatch):
    chat, out, err = chat_session(tiny_model, tiny_mlx_dir, "--no-think", "-n", "200")
    show, calls = chat.show, []

    def show_then_interrupt(delta):
        calls.append(delta)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return show(delta)

    monkeypatch.setattr(chat, "show", show_then_interrupt)
    feed(chat, "Name a colour.")
    monkeypatch.undo()
    assert "| cancelled]" in err.getvalue()
    (reply_tokens,) = [int(line.split(" | decode ")[1].split()[0]) for line in err.getvalue().splitlines()
                       if line.startswith("[prefill ")]
    assert reply_tokens < 200
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] and chat.messages[1]["content"]
    feed(chat, "Another one?")  # the conversation goes on from the cut reply
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2
    assert err.getvalue().count("| length]") == 1


def test_a_full_context_offers_trim_which_drops_the_oldest_turns(tiny_model, tiny_mlx_dir):
    chat, _, err = chat_session(tiny_model, tiny_mlx_dir, "--no-think", "--context", "64")
    feed(chat, "Name a colour.", "Another one?", "And one more?")
    (refused,) = [line for line in err.getvalue().splitlines() if line.startswith("[the conversation is ")]
    assert "more than the context's 64" in refused and "/trim" in refused and "/reset" in refused
    assert len(chat.messages) == 4  # the message that did not fit is not in the history
    feed(chat, "/trim")
    assert "[dropped " in err.getvalue()
    user = [m["content"] for m in chat.messages if m["role"] == "user"]
    assert user[-1] == "And one more?" and "Name a colour." not in user
    assert stats(err)[-1][0] + stats(err)[-1][1] <= 64 - 12  # room left for the reply
    assert chat.messages[-1]["role"] == "assistant"


def test_a_message_longer_than_the_context_says_so(tiny_model, tiny_mlx_dir):
    chat, _, err = chat_session(tiny_model, tiny_mlx_dir, "--no-think", "--context", "64")
    feed(chat, "word " * 100, "/trim")
    assert "[this message alone is " in err.getvalue() and "/trim drops" not in err.getvalue()
    assert chat.messages == [] and "[dropped 0 oldest turns" in err.getvalue()


def test_speculative_chat_turns_are_the_plain_ones(tmp_path):
    """--speculative mtp: two turns through the prefix cache print what the plain chat prints."""
    import lily
    from lily import synthetic

    path = synthetic.write_checkpoint(tmp_path / "mtp", layout="mlx", seed=0, mtp=True)
    outputs = []
    for flags, mtp in (((), False), (("--speculative", "mtp", "--draft-tokens", "2"), True)):
        chat, out, _ = chat_session(lily.Model.load(str(path), device="cpu", mtp=mtp), path, *flags)
        feed(chat, "Why is the sky blue?", "Tell me more.")
        outputs.append(out.getvalue())
    assert outputs[1] == outputs[0] and outputs[0].strip()
