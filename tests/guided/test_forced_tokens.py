"""Forced (jump-forward) draft tokens from a matcher standing inside a multi-byte character.

Found by the fuzzing suite (issue 75): a regex guide of non-ASCII characters, after a byte-level
token that carries only the first byte of `Á`, made xgrammar's jump-forward string start with the
continuation byte 0x81; decoding it raised UnicodeDecodeError inside the decode step, which failed
the request with an internal error. Drafting is optional: the matcher offers no forced tokens there,
and the request goes on to write the guide's text (llguidance drafts the bytes that follow)."""
from __future__ import annotations

import pytest

from specguide.request import GuidedDecodingParams as G

REGEX = "\u00c1\u00fb\u00f2\x15k_"


def _byte_token(service, byte: int) -> int:
    """The byte-level BPE token that stands for one raw byte."""
    return next(t for t, b in enumerate(service.token_bytes) if b == bytes([byte]))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_no_forced_tokens_from_inside_a_character(xgr_service, hf_tokenizer, backend):
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    m = xgr_service.compile(G("regex", REGEX, backend=backend)).matcher()
    first = REGEX.encode("utf-8")[0]  # 0xC3: Á is C3 81
    assert m.accept(_byte_token(xgr_service, first))
    # xgrammar raised UnicodeDecodeError here; now it drafts nothing, llguidance the bytes that follow
    forced = m.forced_tokens(encode, 4)
    assert REGEX.encode("utf-8")[1:].startswith(b"".join(xgr_service.token_bytes[t] for t in forced))
    rest = REGEX.encode("utf-8")[1:]
    assert all(m.accept(_byte_token(xgr_service, b)) for b in rest)  # the guide's text, byte by byte
    assert m.is_completed()


def test_forced_tokens_resume_once_the_character_is_whole(xgr_service, hf_tokenizer):
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    m = xgr_service.compile(G("regex", REGEX, backend="xgrammar")).matcher()
    data = REGEX.encode("utf-8")
    for b in data[:2]:  # Á whole
        assert m.accept(_byte_token(xgr_service, b))
    forced = m.forced_tokens(encode, 8)
    assert forced and hf_tokenizer.decode(forced) == REGEX[1:].rstrip()[: len(hf_tokenizer.decode(forced))]
