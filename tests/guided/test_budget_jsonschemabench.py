"""Issue 80: every JSON answer the served default guides closes within a small budget, over the whole
JSONSchemaBench sample (180 schemas: anyOf / oneOf branches, allOf, $ref, patternProperties, enums
and consts inside branches, formats and patterns half written). Two "models" that never close
anything on their own (the rambler; a seeded random pick of the allowed tokens) write each answer
through the real tokenizer and the served grammar backend (`auto`: llguidance for JSON schemas); each
answer must end with the stop token by max_tokens, parse, and validate. A schema is left out only
where no answer can end with "stop" within the budget (refused up front, or its shortest answer
fits only without the stop token) or the backend refuses to compile it."""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from specguide.guided.budget import completion_cap, within_budget
from specguide.guided.json_scanner import Scanner
from specguide.guided.schema_completion import Schemas
from specguide.guided.value_check import make_validator
from specguide.request import GuidedDecodingParams as G
from specguide.request import InvalidRequestError

from .conftest import VOCAB
from .helpers import data_dir, rambler


def random_pick(seed: int):
    rng = random.Random(seed)
    ids = np.arange(VOCAB)

    def pick(mask: torch.Tensor) -> int:
        words = mask[0].numpy().view(np.uint32)
        allowed = np.flatnonzero((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1)
        assert len(allowed), "an empty mask"
        return int(allowed[rng.randrange(len(allowed))])
    return pick


@pytest.mark.parametrize("budget", [40, 96])
def test_every_answer_over_the_sample_closes_valid_within_max_tokens(served_service, hf_tokenizer, budget):
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    stop = served_service.stop_token_ids[0]
    pickers = {"rambler": rambler(hf_tokenizer, VOCAB), "random": random_pick(budget)}
    files = sorted(data_dir("jsonschemabench_dev").glob("*/*.json"))
    assert len(files) == 180
    closed, failures = 0, []
    for f in files:
        text = f.read_text()
        try:
            guide = served_service.compile(G("json_schema", text))
        except Exception:
            continue  # refused with a per-request error (test_compiler covers which and how)
        scanner = lambda: Scanner(Schemas(guide.schema, completion_cap(budget, served_service.token_bytes)))  # noqa: E731
        try:
            wrapped = within_budget(guide, scanner, budget, served_service.token_bytes, encode, stop)
        except InvalidRequestError as e:
            assert f"max_tokens {budget} cannot hold a valid answer" in str(e)
            continue
        if wrapped.budget is None:  # only where the shortest answer's text fits and its stop token does not
            shortest = encode(scanner().completion(scanner().start()))
            assert len(shortest) <= budget < len(shortest) + 1, (f.name, len(shortest))
            continue
        schema = json.loads(text)
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
            validator = make_validator(schema)
        except jsonschema.SchemaError:
            validator = None  # a schema its own metaschema refuses (a repeated enum value): parsing is checked
        for name, pick in pickers.items():
            m = wrapped.matcher()
            mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
            out: list[int] = []
            while not m.is_terminated() and len(out) < budget:
                m.fill(mask, 0)
                t = pick(mask)
                assert m.accept(t)
                out.append(t)
            answer = hf_tokenizer.decode(out[:-1] if out and out[-1] == stop else out)
            if not out or out[-1] != stop:
                failures.append((f.name, name, "no stop token by max_tokens", answer[-120:]))
                continue
            try:
                doc = json.loads(answer)
            except ValueError:
                failures.append((f.name, name, "does not parse", answer[-120:]))
                continue
            if validator is not None and not validator.is_valid(doc):
                failures.append((f.name, name, "does not validate", answer[-120:]))
            closed += wrapped.budget.closed(out)
    assert not failures, failures
    assert closed >= 200  # most of the 2 x ~160 answers ran into the budget: it closed them
