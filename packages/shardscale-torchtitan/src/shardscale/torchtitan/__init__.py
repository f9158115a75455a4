"""shardscale.torchtitan: torchtitan's ``clip_grad_norm_`` signature with one collective.

Quick start (in torchtitan's ``Trainer.train_step``, or any loop that calls
torchtitan's clipping)::

    from shardscale.torchtitan import clip_grad_norm_   # was: dist_utils.clip_grad_norm_

    grad_norm = clip_grad_norm_(params, max_norm, foreach=True,
                                pp_mesh=parallel_dims.get_optional_mesh("pp"),
                                ep_enabled=parallel_dims.ep_enabled)

See docs/torchtitan.md for the layouts it was checked on against torchtitan's
own function and for an fp16 recipe. It does not import torchtitan.
"""

from __future__ import annotations

from shardscale.torchtitan._clip import clip_grad_norm_

__all__ = ["clip_grad_norm_", "TESTED_TORCHTITAN"]

#: The torchtitan release the tests compare with (noxfile TEST_FRAMEWORKS pins it).
TESTED_TORCHTITAN = "0.3.0"
