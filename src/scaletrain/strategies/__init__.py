"""The synchronisation strategies.

traits.py is the table of what each strategy is (torch-free: the launcher, config validation
and the performance model read it); base.py the one interface every strategy implements; one
module per strategy; build.py the only map from a strategy's name to the class that runs it.
This package re-exports the traits alone, so importing it loads no torch.
"""

from .traits import (REGISTRY, Traits, entry, images_per_update, lost_with, push_images, pushers, survivable,
                     tolerant, wait_for)

__all__ = ["REGISTRY", "Traits", "entry", "images_per_update", "lost_with", "push_images", "pushers",
           "survivable", "tolerant", "wait_for"]
