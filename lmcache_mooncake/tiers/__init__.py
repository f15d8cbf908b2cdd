"""Storage tiers plugged into LMCache's engine after its CPU tier.

- :mod:`.disk`: a persistent folder of verified chunk files;
- :mod:`.mooncake`: the shared Mooncake Store;
- :mod:`.base`: what both share (LMCache's remote-connector contract for
  verified chunks) and the per-engine :class:`~.base.EngineContext`;
- :mod:`.writes`: tracking of unfinished writes.
"""
