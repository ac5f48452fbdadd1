"""Incremental detokenisation: deltas equal the full decode, stop strings, hold-back, bounded cost."""

from __future__ import annotations

import random
from typing import Any

import pytest

from chunkserve.workers.output import Detokenizer
from chunkserve.workers.sampling import SamplingParams

TEXT = ("The quick brown fox jumps over the lazy dog. Héllo wörld, ça va? Grüße aus Köln! "
        "你好，世界。日本語のテキストです。 Ελληνικά και русский текст. Emoji: 🤖🎉👩‍👩‍👧 ✓ ∑ ≠ ∞. "
        "def f(x):\n    return x ** 2  # 🐍\n")


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    from chunkserve.workers.weights import embedded_checkpoint_dir

    return AutoTokenizer.from_pretrained(str(embedded_checkpoint_dir()), local_files_only=True)


class QuadraticReference:
    """The pre-issue-12 Detokenizer (re-decodes everything per token): the behaviour to keep."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer, self.stops, self.ids, self.emitted, self.text = tokenizer, params.stop, [], 0, ""
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def add(self, token_id: int, final: bool = False) -> tuple[str, bool]:
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stops:
            hits = [(self.text.find(s, max(0, self.emitted - len(s))), s) for s in self.stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                cut = min(i for i, _ in hits)
                self.text = self.text[:cut]
                out = self.text[self.emitted:]
                self.emitted = len(self.text)
                return out, True
        if final:
            return self.flush(), False
        end = len(self.text)
        if self.text.endswith("\ufffd"):
            end = self.text.rfind("\ufffd")
            while end > 0 and self.text[end - 1] == "\ufffd":
                end -= 1
        end = max(self.emitted, end - self._hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out, False

    def flush(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.calls.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def run(detok: Any, ids: list[int], flush_at_end: bool = True) -> tuple[list[str], bool]:
    """Feed ids as the engine does; returns (the deltas, whether a stop string ended the output)."""
    deltas = []
    for j, t in enumerate(ids):
        text, stopped = detok.add(t, final=flush_at_end and j == len(ids) - 1)
        deltas.append(text)
        if stopped:
            return deltas, True
    return deltas, False


def random_ids(tok: Any, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(len(tok)) for _ in range(n)]


def text_ids(tok: Any, repeats: int = 1) -> list[int]:
    return list(tok.encode(TEXT * repeats, add_special_tokens=False))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deltas_concatenate_to_the_full_decode_for_long_random_outputs(tok: Any, seed: int) -> None:
    ids = random_ids(tok, 3000, seed)
    deltas, stopped = run(Detokenizer(tok, SamplingParams()), ids)
    assert not stopped
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_deltas_concatenate_to_the_full_decode_for_multibyte_text(tok: Any) -> None:
    ids = text_ids(tok, repeats=20)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some tokens hold partial UTF-8 characters
    deltas, _ = run(Detokenizer(tok, SamplingParams()), ids, flush_at_end=False)
    assert "".join(deltas) == TEXT * 20
    assert not any("\ufffd" in d for d in deltas)  # incomplete characters were held back, never emitted
    assert "" in deltas[:200]  # ... while a character was still incomplete


def test_incomplete_utf8_at_the_end_is_emitted_by_flush(tok: Any) -> None:
    robot = list(tok.encode("ok 🤖", add_special_tokens=False))
    head = robot[:-1]  # the emoji's last byte(s) missing
    detok = Detokenizer(tok, SamplingParams())
    deltas, _ = run(detok, head, flush_at_end=False)
    assert "".join(deltas) == "ok "
    assert detok.flush() == tok.decode(head)[3:]  # U+FFFD for the partial character
    assert detok.flush() == ""


def test_stop_string_spanning_tokens_ends_the_output_and_is_not_emitted(tok: Any) -> None:
    text = "Once upon a time there was a fox. The end is near, said the fox."
    ids = list(tok.encode(text, add_special_tokens=False))
    stop = "The end is"
    assert all(stop not in tok.decode([t]) for t in ids)  # the stop spans several tokens
    deltas, stopped = run(Detokenizer(tok, SamplingParams(stop=(stop, "never-there"))), ids)
    assert stopped
    assert "".join(deltas) == "Once upon a time there was a fox. "
    assert tok.decode(ids[:len(deltas)]).endswith(" is")  # stopped at the token that completed it


def test_a_possible_stop_prefix_is_held_back_then_released(tok: Any) -> None:
    text = "alpha END beta ENDING gamma"
    ids = list(tok.encode(text, add_special_tokens=False))
    detok = Detokenizer(tok, SamplingParams(stop=("END!",)))
    deltas, stopped = run(detok, ids, flush_at_end=False)
    assert not stopped
    assert len("".join(deltas)) <= len(text) - 3  # the last 3 chars may start "END!": held back
    assert "".join(deltas) + detok.flush() == text


@pytest.mark.parametrize("seed", range(6))
def test_every_step_matches_the_quadratic_detokenizer_with_random_stop_strings(tok: Any, seed: int) -> None:
    rng = random.Random(seed)
    ids = text_ids(tok, repeats=3) if seed % 2 else random_ids(tok, 600, seed)
    full = tok.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(rng.randrange(1, 4)):
        a = rng.randrange(len(full) // 2, len(full) - 8)
        stops.append(full[a:a + rng.randrange(1, 8)] if rng.random() < 0.7 else "zz-not-there-zz")
    stops = [s for s in stops if s]
    params = SamplingParams(stop=tuple(stops))
    new, old = Detokenizer(tok, params), QuadraticReference(tok, params)
    for j, t in enumerate(ids):
        final = j == len(ids) - 1
        got, want = new.add(t, final=final), old.add(t, final=final)
        assert got == want, (j, stops)
        if got[1]:
            break
    assert new.flush() == old.flush()


def test_decode_work_per_token_stays_bounded_as_the_output_grows(tok: Any) -> None:
    ids = text_ids(tok, repeats=40)  # ~2000+ tokens of multi-byte text
    assert len(ids) > 2000
    counting = CountingTokenizer(tok)
    deltas, _ = run(Detokenizer(counting, SamplingParams(stop=("never-there",))), ids)
    assert "".join(deltas) == TEXT * 40
    assert max(counting.calls) <= 8  # ids per decode call: a small window, not the whole output
    late = counting.calls[len(counting.calls) // 2:]
    early = counting.calls[:len(counting.calls) // 2]
    assert sum(late) <= 1.2 * sum(early) + 16  # the second half costs no more than the first


def test_the_quadratic_detokenizer_fails_the_bounded_work_check(tok: Any) -> None:
    """The check above can fail: the old detokenizer decodes the whole output every token."""
    ids = text_ids(tok, repeats=2)
    counting = CountingTokenizer(tok)
    run(QuadraticReference(counting, SamplingParams()), ids)
    assert max(counting.calls) == len(ids) > 8


def test_without_a_tokenizer_nothing_is_emitted() -> None:
    deltas, stopped = run(Detokenizer(None, SamplingParams(stop=("x",))), [1, 2, 3])
    assert deltas == ["", "", ""] and not stopped
