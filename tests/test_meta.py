"""autopart.meta spells every metadata key once: no code spells one as a literal."""

import io
import re
import tokenize
from pathlib import Path

from autopart import meta

REPO = Path(__file__).resolve().parents[1]
KEY = re.compile(r"""^(['"])autopart\.[a-z_]+\1$""")


def test_keys_are_distinct_and_namespaced() -> None:
    values = list(meta.KEYS.values())
    assert len(values) == len(set(values))
    assert all(v.startswith("autopart.") for v in values)


def test_no_key_is_spelled_outside_meta() -> None:
    found = []
    for path in [*REPO.joinpath("autopart").rglob("*.py"), *REPO.joinpath("passes").rglob("*.py")]:
        if path.name == "meta.py" and path.parent.name == "autopart":
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            spelled = tok.type == tokenize.STRING and KEY.match(tok.string)
            if spelled and tok.string[1:-1] != "autopart.json":  # the checkpoint's marker file
                found.append(f"{path.relative_to(REPO)}:{tok.start[0]} {tok.string}")
    assert not found, "metadata keys spelled as literals (use autopart.meta):\n" + "\n".join(found)


def test_the_check_sees_a_literal() -> None:
    """Negative control: the pattern the check uses does match a spelled key."""
    tokens = tokenize.generate_tokens(io.StringIO('n.meta["autopart.shard"]\n').readline)
    assert any(t.type == tokenize.STRING and KEY.match(t.string) for t in tokens)
