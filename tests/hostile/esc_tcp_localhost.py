# class: escape
# mode: asserts
# what: TCP to a localhost listener, around any socket stub
import sys
sys.modules.pop('_socket', None)
import _socket
s = _socket.socket()
s.settimeout(1)
s.connect(('127.0.0.1', __PORT__))
def add(a, b):
    return 0
