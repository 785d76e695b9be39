"""Fabric probe: multi-node collectives that find a bad node or link."""
