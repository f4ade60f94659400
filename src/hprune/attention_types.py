"""The three attention types (Voita et al.'s names) and their validation: the one home of both, shared by
hprune and its fairseq plugin (which imports nothing else of hprune). No heavy import here."""
from __future__ import annotations

from typing import Iterable, List

from .errors import UserError

ATTENTION_TYPES = ("enc-self", "dec-self", "dec-enc")
# the feed-forward sublayers, whose hidden units (neurons) a mask may hold beside the heads, under these keys
FFN_TYPES = ("enc-ffn", "dec-ffn")
# the stack each sublayer lies in (CTranslate2 holds one head count per stack)
STACK = {"enc-self": "encoder", "dec-self": "decoder", "dec-enc": "decoder", "enc-ffn": "encoder", "dec-ffn": "decoder"}


def check_attention_types(types: Iterable[str] | str, setting: str, example: str = "[enc-self]") -> List[str]:
    """`types` as a list (a comma-separated string is split); one or more known types, else one UserError
    line naming `setting`."""
    types = [t for t in types.split(",") if t] if isinstance(types, str) else [str(t) for t in types]
    unknown = [t for t in types if t not in ATTENTION_TYPES]
    choose = f"choose one or more of {', '.join(ATTENTION_TYPES)}, e.g. {setting}={example}"
    if unknown:
        raise UserError(f"{setting}={types} names unknown attention type(s) {unknown}; {choose}")
    if not types:
        raise UserError(f"{setting}=[] names no attention type; {choose}")
    return types
