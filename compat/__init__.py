"""Engine and library version knowledge in one place: detection, supported ranges, shims, doctor.

Adapters ask compat/ which API a given engine version has; nothing else probes versions.
"""
