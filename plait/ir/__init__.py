"""plait's neutral IR: the pure data types that planners, simulator and runtime share.

Modules here import nothing from the planners, the simulator or the runtime."""
