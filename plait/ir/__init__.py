"""plait's neutral IR: plain data types every room shares (plans, op graphs, stage graphs, timelines)."""
