"""Field types shared by the REST bodies."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def _utf8(s: str) -> str:
    # JSON can carry lone surrogates ("\ud800"); protobuf strings and our UTF-8 responses cannot.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (no lone surrogate escapes like \\ud800)") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
