# class: escape
# mode: asserts
# what: open raw devices
for p in ('/dev/vda', '/dev/sda', '/dev/mem', '/dev/kmsg', '/dev/nvidia0'):
    try:
        open(p, 'rb').read(1)
        print('opened', p)
    except OSError as e:
        print(p, type(e).__name__)
def add(a, b):
    return 0
