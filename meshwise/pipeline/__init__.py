"""Pipeline parallelism: schedules as data (validated, replayed, simulated; pure), the runtime."""
