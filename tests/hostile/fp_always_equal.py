# class: false_pass
# mode: asserts
# what: return an object whose __eq__ is always True
class Any:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = object.__hash__
def add(a, b):
    return Any()
