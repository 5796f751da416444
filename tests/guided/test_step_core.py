"""One step core (step.py) for the eager path and the CUDA graph: the graph body, run eagerly on
its padded, bucketed static buffers with the grammar callbacks on a worker thread (races show),
gives the plain engine's tokens, drafts and acceptance for every drafter; guided and unguided
rows mixed, greedy and sampled, batch 1 and 8."""
from __future__ import annotations

import pytest

from specguide.config import EngineConfig
from specguide.cuda.graphs import StepGraphs
from specguide.engine.loop import Engine

from .helpers import save_random_head
from .test_capturable import GUIDES, MIXED_K, _requests, _run

SAMPLED = {1, 5}  # a guided and an unguided row sample (their seeded tokens verify the drafts)


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    return str(save_random_head(tmp_path_factory.mktemp("head") / "random.pt"))


def _engine(drafter: str, head: str, executor: str) -> Engine:
    # cost_aware_k off: drafts and acceptance compare across engines (no clock decides whether a step drafts)
    return Engine(EngineConfig(max_slots=8, max_seq_len=512, prefill_chunk=64, warmup=False, spec_max_rows=0,
                               num_draft_tokens=3, drafter=drafter, draft_head_path=head, draft_layers=20,
                               guided_executor=executor, cost_aware_k=False))


@pytest.mark.parametrize("drafter", ["hybrid", "head", "grammar", "ngram", "early_exit", "draft_model"])
def test_graph_body_with_worker_callbacks_equals_the_plain_engine(drafter, random_head):
    plain, worker = _engine(drafter, random_head, "inline"), _engine(drafter, random_head, "worker")
    try:
        worker.core.guided.stepper.configured.delay_s = 2e-4  # widen any window in which the host reads too early
        graphs = worker.core.step_graphs = StepGraphs(worker.core.runner.core)  # CPU: replay runs the body eagerly
        assert plain.core.drafter == worker.core.drafter == drafter
        reqs = lambda e: _requests(e, k_of=lambda i: MIXED_K[i], max_tokens=20, sampled=SAMPLED)  # noqa: E731
        want = _run(plain, reqs(plain))  # batch 8 (and the 9th request joins as others finish)
        got = _run(worker, reqs(worker))
        alone = [0, 1, 6]  # batch 1: a guided greedy, a guided sampled, an unguided row
        want1 = [_run(plain, [reqs(plain)[i]])[0] for i in alone]
        got1 = [_run(worker, [reqs(worker)[i]])[0] for i in alone]
        keys = set(graphs.graphs)
        for eng in (plain, worker):
            eng.core.scheduler.check_integrity()
            eng.core.guided.synchronize()
            assert all(m is None for m in eng.core.guided.inner.matchers)
    finally:
        plain.shutdown()
        worker.shutdown()
    assert got == want  # tokens, finish reasons, drafts verified and accepted
    assert got1 == want1 and [g[0] for g in got1] == [want[i][0] for i in alone]  # batch 1 == batch 8
    assert sum(w[2] for w in want) > 0, "nothing was drafted"
    assert sum(1 for toks, reason, _, _ in want[: len(GUIDES)] if reason == "stop") >= 2  # grammars end
    drafting = "host" if drafter in ("grammar", "ngram") else "model"
    assert any(k.drafting == drafting and k.guided for k in keys)
    assert any(k.batch > 1 and not k.greedy for k in keys) and any(k.batch == 1 for k in keys)
    assert any(k.batch in (4, 8) for k in keys)  # padded buckets: rows 3, 5..7 run as 4 / 8
    assert all(k.pick == (drafter == "hybrid") for k in keys if k.drafting == "model")
    if drafter in ("hybrid", "grammar"):
        assert sum(w[3] for w in want) > 0, "no draft was accepted"
