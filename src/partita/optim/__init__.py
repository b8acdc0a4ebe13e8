"""The optimizer: AdamW on flat slices, the learning-rate schedule, gradient clipping.

Plain tensor math with no process group of its own: the data-parallel engine
(partita.zero) decides which slice each rank updates and calls these on it.
"""

from partita.optim.adamw import AdamWConfig, AdamWState, adamw_, adamw_scratch
from partita.optim.clip import clip_coefficient, global_norm, squared_sum
from partita.optim.schedule import WarmupCosine

__all__ = ["AdamWConfig", "AdamWState", "WarmupCosine", "adamw_", "adamw_scratch",
           "clip_coefficient", "global_norm", "squared_sum"]
