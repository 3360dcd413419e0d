"""Profiles, the per-op numerical contract, and the doctor that checks it on this machine."""

from rlalign.contract.errors import ContractError
from rlalign.contract.profiles import Profile, as_profile, current_profile, use_profile
from rlalign.contract import spec

__all__ = ["ContractError", "Profile", "as_profile", "current_profile", "use_profile", "spec"]
