"""Generated protocol code for tokembed.v1; regenerate with scripts/gen_protos.py."""
