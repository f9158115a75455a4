"""Test-only shardscale plugin (shardscale-bad-claims): a grad adapter whose claims() raises during a step."""

from __future__ import annotations

from shardscale.core import PlainTensorAdapter, hookimpl

CALLS = []


class RaisingClaims(PlainTensorAdapter):
    name = "raising-claims"
    priority = 50

    def claims(self, param):
        CALLS.append(tuple(param.shape))
        raise RuntimeError("bad_claims: cannot tell")


@hookimpl
def shardscale_grad_adapters():
    return [RaisingClaims()]
