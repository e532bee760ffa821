# class: false_pass
# mode: calls
# what: list subclass with __eq__ always True
class L(list):
    def __eq__(self, o): return True
def add(a, b):
    return L()
