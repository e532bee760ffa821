# class: escape
# mode: asserts
# what: look for host command lines in /proc
import os
for pid in os.listdir('/proc'):
    try:
        print(open('/proc/%s/cmdline' % pid, 'rb').read().replace(b'\0', b' ').decode())
    except OSError:
        pass
def add(a, b):
    return 0
