"""Profiles, the per-op numerical contract, and the one definition of bit equality (``contract.bits``).

``contract.bits`` (torch) is imported where it is used (``from rlalign.contract.bits import ...``), not here:
the errors and the spec stay importable without torch (the reward worker process, the config loader).
"""

from rlalign.contract.errors import ContractError
from rlalign.contract.profiles import Profile, as_profile, current_profile, use_profile
from rlalign.contract import spec

__all__ = ["ContractError", "Profile", "as_profile", "current_profile", "use_profile", "spec"]
