"""Preference optimization (docs/dpo.md, docs/odpo.md): offline.py (`tether dpo|kto|simpo|orpo`:
the DPO family, KTO, SimPO, ORPO on preference data; `train_step` is the one optimizer step of
every pairwise objective), data.py (rows -> examples, collation), objective.py (per-sequence
log-probs -> the method's loss and metrics), reference.py (the reference's log-probs, computed
once and cached in the run directory), online.py (`tether odpo`: online / iterative DPO on pairs
the current policy samples and a reward, or the policy itself, ranks)."""

from tether.trainers.preference.offline import (DPOConfig, KTOConfig, OfflineConfig, ORPOConfig, PreferenceSection,
                                                SimPOConfig, train_offline)
from tether.trainers.preference.online import ODPOConfig, train_odpo

__all__ = ["DPOConfig", "KTOConfig", "OfflineConfig", "ORPOConfig", "PreferenceSection", "SimPOConfig",
           "train_offline", "ODPOConfig", "train_odpo"]
