"""Taking a node out of service, and back: owned cordons and drains.

gpumon only ever lifts what gpumon put there, records that it did it, when and
why, and never leaves a node out for a finding with action ``none``.
"""
