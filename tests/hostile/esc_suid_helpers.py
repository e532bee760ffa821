# class: escape
# mode: asserts
# what: run setuid helpers (su, sudo, mount)
import subprocess
for cmd in (['su', '-c', 'id'], ['sudo', 'id'], ['mount', '-t', 'tmpfs', 'x', '/tmp']):
    try:
        print(subprocess.run(cmd, capture_output=True, timeout=2, stdin=subprocess.DEVNULL))
    except Exception as e:
        print(cmd, e)
def add(a, b):
    return 0
