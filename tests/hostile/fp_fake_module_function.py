# class: false_pass
# mode: asserts
# tests: ["assert math.isclose(area(2), 12.566)"]
# what: a function named like a module, carrying an always-true attribute
def math():
    pass
math.isclose = lambda *a, **k: True
def area(r):
    return 0
