# class: escape
# mode: asserts
# what: AF_UNIX connect to an abstract socket outside
import socket
s = socket.socket(socket.AF_UNIX)
s.connect('\0__ABSTRACT__')
s.sendall(b'escaped')
def add(a, b):
    return 0
