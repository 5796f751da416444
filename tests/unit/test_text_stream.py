"""TextStream: a request's text made from its token events, where they are read (the stub, or the
in-process Engine's callback): deltas add up to the full decode, stop strings cut it exactly wherever
the events split it, held-back text follows the ending, and what the engine makes after a stop string
never reaches the client."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from specguide.request import RequestOutput, SamplingParams
from specguide.text_stream import TextStream
from specguide.tokenizer import TokenizerFile

WORDS = ["The", " answer", " is", ":", " Paris", ".", "\n\n", " naïve", " café", " 日本語", " 🙂", " {\"a\": 1}",
         " stop", "STOP", " end", " x", "y"]


@pytest.fixture(scope="module")
def tok():
    from specguide.models.loader import resolve_model_dir

    return TokenizerFile(resolve_model_dir())


class Run:
    """Feeds a stream events of token chunks, as the engine sends them; records what passes."""

    def __init__(self, tok, guided: bool = False, **params):
        self.stops = 0
        self.nonfinal_ids: list[int] = []  # the tokens of the events before the final one
        self.passed: list[RequestOutput] = []
        self.stream = TextStream(tok, SamplingParams(**params), self._stop, guided)

    def _stop(self) -> None:
        self.stops += 1

    def feed(self, chunks: list[list[int]], reason: str = "length", final_ids: list[int] = (), **extra) -> None:
        sent = 0
        for ids in chunks:
            sent += len(ids)
            self._take(RequestOutput(seq_id=1, token_ids=list(ids), num_output_tokens=sent, **extra))
        self._take(RequestOutput(seq_id=1, token_ids=list(final_ids), finished=True, finish_reason=reason,
                                 num_output_tokens=sent + len(final_ids), **extra))

    def _take(self, out: RequestOutput) -> None:
        if not out.finished:
            self.nonfinal_ids += out.token_ids
        got = self.stream.take(out)
        if got is not None:
            self.passed.append(got)

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.passed)

    @property
    def ids(self) -> list[int]:
        return [t for o in self.passed for t in o.token_ids]


def _split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    edges = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(edges, edges[1:])]


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=24), cuts=st.lists(st.integers(0, 200), max_size=8),
       stop_at=st.one_of(st.none(), st.tuples(st.integers(0, 400), st.integers(1, 6))), include=st.booleans())
def test_text_is_the_full_decode_cut_at_the_first_stop_string_however_events_split_it(tok, words, cuts, stop_at,
                                                                                         include):
    ids = tok.encode("".join(words))
    full = tok.decode(ids)
    stop = []
    if stop_at is not None and full.strip():
        start = stop_at[0] % len(full)
        stop = [full[start: start + stop_at[1]]]
    run = Run(tok, max_tokens=100, stop=stop + ["\x00never"], include_stop_str_in_output=include)
    run.feed(_split(ids, cuts))
    final = run.passed[-1]
    assert final.finished and sum(o.finished for o in run.passed) == 1
    if stop:
        i = full.find(stop[0])
        assert run.text == full[: i + len(stop[0]) if include else i]
        assert final.finish_reason == "stop" and run.stops <= 1
        assert final.num_output_tokens == len(run.ids) and run.ids == ids[: len(run.ids)]
        # the engine is asked to stop once where a running request's text reached the stop string
        assert run.stops == (1 if stop[0] in tok.decode(run.nonfinal_ids) else 0)
    else:
        assert run.text == full and run.ids == ids and final.finish_reason == "length" and run.stops == 0


def _events_past_a_stop_string(tok):
    """The engine's events for a request whose text reaches " The" in its first event: one more
    step's tokens, then its final event (the stop the stream asked for), with guide notes."""
    ids = tok.encode("The answer is: Paris. The end of it all")
    k = len(tok.encode("The answer is: Paris."))
    return ids, k, [
        RequestOutput(seq_id=1, token_ids=ids[:k + 1], num_output_tokens=k + 1, logprobs=[-0.5] * (k + 1),
                      cum_logprob=-0.5 * (k + 1), generation_logits=np.ones((k + 1, 7), np.float32)),
        RequestOutput(seq_id=1, token_ids=ids[k + 1:k + 3], num_output_tokens=k + 3, logprobs=[-1.0] * 2),
        RequestOutput(seq_id=1, token_ids=ids[k + 3:k + 4], finished=True, finish_reason="stop",
                      num_output_tokens=k + 4, logprobs=[-2.0], cum_logprob=-99.0, stage="decode",
                      guide_notes=("not enforced: x",), generation_logits=np.ones((1, 7), np.float32))]


@pytest.mark.parametrize("guided", [False, True])
def test_a_stop_string_ends_the_request_with_its_event_and_the_engines_later_tokens_never_reach_the_client(
        tok, guided):
    """The event whose text reaches the stop string is the request's final one (the engine is asked
    to stop). A guided request's waits for the engine's final event, whose stage and guide notes it
    takes; an unguided one's goes out at once. Either way: one final event, the stop event's tokens
    and values."""
    ids, k, events = _events_past_a_stop_string(tok)
    run = Run(tok, guided=guided, max_tokens=100, stop=[" The"])
    seen = []
    for e in events:
        run._take(e)
        seen.append(len(run.passed))
    assert seen == ([0, 0, 1] if guided else [1, 1, 1]) and run.stops == 1
    final = run.passed[0]
    assert (final.finished, final.finish_reason, final.error, final.error_code) == (True, "stop", None, None)
    assert final.text == "The answer is: Paris." and final.token_ids == ids[:k + 1]
    assert final.logprobs == [-0.5] * (k + 1) and final.generation_logits.shape == (k + 1, 7)
    assert final.num_output_tokens == k + 1 and final.cum_logprob == -0.5 * (k + 1)
    assert final.stage == "decode" and final.guide_notes == (("not enforced: x",) if guided else ())


@pytest.mark.parametrize("reason,kept", [("length", True), ("timeout", True), ("stop", True), ("cancelled", False),
                                         ("error", False)])
def test_held_back_text_follows_the_ending(tok, reason, kept):
    """Text that could begin a stop string waits; the end flushes it, but a cancel or an error
    (without new tokens) drops it."""
    ids = tok.encode("Hello there, my fri")
    run = Run(tok, max_tokens=100, stop=["friend"])
    run.feed([ids], reason=reason)
    full = tok.decode(ids)
    assert run.text == (full if kept else full[: len(full) - (len("friend") - 1)])  # what could begin it
    assert run.passed[-1].finish_reason == reason and run.stops == 0


def test_an_error_with_tokens_outputs_them_and_a_stop_string_among_them_wins(tok):
    """A guide that rejects a drawn token ends the request with an error whose event carries the
    tokens before it: their text goes out; where it holds a stop string, the request stopped first."""
    ids = tok.encode("Hello there, my fri")
    run = Run(tok, max_tokens=100, stop=["friend"])
    run.feed([ids[:2]], reason="error", final_ids=ids[2:])
    assert run.text == tok.decode(ids) and run.passed[-1].finish_reason == "error"
    run = Run(tok, max_tokens=100, stop=[" my"])
    run.feed([ids[:2]], reason="error", final_ids=ids[2:], error="rejected")
    assert run.text == "Hello there," and run.passed[-1].finish_reason == "stop" and run.passed[-1].error is None
