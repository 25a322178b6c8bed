"""Library custom ops: which namespaces a program may call besides ATen and autopart's own.

Capture decomposes a library's op to ATen where a decomposition is known
(``frontend/capture.LIBRARY_DECOMPOSITIONS``, torch's tables); an op with none is refused by
``compile_program`` unless the user trusts its namespace at compile time
(``Plan.library_ops``). The namespace must be the import name of an installed distribution's
package (``torch.ops.mylib.*`` from the package ``mylib``): the program records, per namespace
its graphs call, that distribution's version (``plan.json``'s ``libraries``).

Loading such a program imports the library, which runs its code, so a file never chooses it:
the loading user names the namespaces they trust (``load_rank(..., library_ops=...)``,
``autopart run --library-ops``). The loader refuses a program calling a namespace not named,
imports each named one that the program records, and refuses a version other than the
recorded one. Stage graphs are then checked against ATen, autopart and those namespaces only.

Data enters as the user's list of names (``check_names``) and the captured graph's ops
(``record``); it leaves as ``plan.json``'s ``{namespace: version}`` and, at load, the tuple of
namespaces the archive checks accept (``trusted``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from autopart.errors import AutopartError
from autopart.layout import BUILTIN_OPS as BUILTIN
from autopart.layout import check_library_names as check_names

VERSION = re.compile(r"[0-9A-Za-z.+!_-]{1,64}")


def installed_version(namespace: str) -> str:
    """The version of the installed distribution that provides the package ``namespace``."""
    dists = importlib.metadata.packages_distributions().get(namespace, [])
    versions = sorted({importlib.metadata.version(d) for d in dists})
    if len(versions) != 1 or not VERSION.fullmatch(versions[0]):
        found = (
            f"{len(dists)} installed distributions provide"
            if versions
            else "no installed distribution provides"
        )
        raise AutopartError(
            f"library namespace {namespace!r}: {found} a package named {namespace!r}, so "
            "autopart cannot tell which version of it the program calls",
            hint=f"install the library that defines torch.ops.{namespace} as a package named "
            f"{namespace!r} (pip install -e . for your own)",
        )
    return versions[0]


def record(namespaces: Iterable[str]) -> dict[str, str]:
    """``{namespace: installed version}`` for the namespaces a program's graphs call."""
    return {ns: installed_version(ns) for ns in sorted(set(namespaces))}


def trusted(recorded: dict[str, str], library_ops: Sequence[str], where: Path) -> tuple[str, ...]:
    """The namespaces the stage graphs of the program at ``where`` may call: ATen, autopart's
    and each namespace ``recorded`` in its ``plan.json``, which the loading user must name in
    ``library_ops``; each one's installed version is checked (from its metadata, before any
    of its code runs), then it is imported, which registers its ops."""
    names = check_names(library_ops)
    for ns, version in sorted(recorded.items()):
        if ns not in names:
            raise AutopartError(
                f"{where} calls ops of the library {ns!r} (version {version} when it was "
                "saved); loading it imports that library, which runs its code, so autopart "
                "loads it only when you name it",
                hint=f"if you trust {ns!r}, pass library_ops=({ns!r},) "
                f"(autopart run --library-ops {ns})",
            )
        have = installed_version(ns)
        if have != version:
            raise AutopartError(
                f"{where} was compiled against {ns} {version}, and {ns} {have} is installed "
                "here: its ops may compute something else",
                hint=f"install {ns}=={version}, or compile the program again with this version",
            )
        try:
            importlib.import_module(ns)
        except Exception as exc:  # noqa: BLE001 - whatever the import raises, name it
            raise AutopartError(
                f"{where} calls ops of the library {ns!r}, which does not import here: "
                f"{type(exc).__name__}: {exc}",
                hint=f"install {ns} {version}",
            ) from None
    return (*BUILTIN, *sorted(recorded))
