"""What happens when something goes wrong, in one place: one rank's error becomes a stop on
every rank (failure.py), which rank left and how (liveness.py), the stall watchdog
(watchdog/), and SIGTERM / Ctrl-C handling with its emergency checkpoint's agreement
(preemption.py)."""
