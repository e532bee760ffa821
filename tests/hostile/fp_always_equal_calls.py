# class: false_pass
# mode: calls
# what: always-equal object for a function-call test
class Any:
    def __eq__(self, o): return True
    __hash__ = object.__hash__
def add(a, b):
    return Any()
