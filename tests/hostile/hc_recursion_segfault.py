# class: hang_crash
# mode: asserts
# what: unbounded recursion past the C stack
import sys
sys.setrecursionlimit(10 ** 7)
def f(n):
    return f(n + 1) + 1
def add(a, b):
    return f(0)
