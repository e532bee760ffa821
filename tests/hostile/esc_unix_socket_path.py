# class: escape
# mode: asserts
# what: AF_UNIX connect to a listener outside
import socket
s = socket.socket(socket.AF_UNIX)
s.connect('__UNIX_SOCK__')
s.sendall(b'escaped')
def add(a, b):
    return 0
