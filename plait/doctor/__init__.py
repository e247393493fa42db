"""The doctor: reads a run's per-rank communication records and heartbeats (live or finished)
and names what is wrong (`plait.ir.diagnosis`): hangs, slow ranks, slow links, mismatches.
Sits beside `plait.measure`: it reads what the runtime wrote and never drives the runtime."""
