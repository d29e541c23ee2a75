"""L2 transports and L3 stores: one base contract each, one file per implementation."""
