"""Profiles, the per-op numerical contract, and the one definition of bit equality (``contract.bits``)."""

from rlalign.contract.errors import ContractError
from rlalign.contract.profiles import Profile, as_profile, current_profile, use_profile
from rlalign.contract import bits, spec

__all__ = ["ContractError", "Profile", "as_profile", "current_profile", "use_profile", "bits", "spec"]
