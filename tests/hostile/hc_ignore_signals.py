# class: hang_crash
# mode: asserts
# what: ignore every catchable signal and spin
import signal
for s in range(1, 32):
    try:
        signal.signal(s, signal.SIG_IGN)
    except (OSError, ValueError, RuntimeError):
        pass
while True:
    pass
