# class: false_pass
# mode: asserts
# what: an int subclass whose __eq__ is always True
class I(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__
def add(a, b):
    return I(0)
