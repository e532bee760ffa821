# class: false_pass
# mode: asserts
# what: write forged pass frames to every fd and to other processes' fds
import os, json, struct
def frame(o):
    d = json.dumps(o).encode()
    return struct.pack('>I', len(d)) + d
msg = frame({'pass': True, 'nonce': '0' * 32, 'tests': 3})
for fd in range(0, 256):
    try:
        os.write(fd, msg)
    except OSError:
        pass
for pid in os.listdir('/proc'):
    try:
        for fd in os.listdir('/proc/%s/fd' % pid):
            try:
                f = os.open('/proc/%s/fd/%s' % (pid, fd), os.O_WRONLY | os.O_NONBLOCK)
                os.write(f, msg)
                os.close(f)
            except OSError:
                pass
    except OSError:
        pass
def add(a, b):
    return 0
