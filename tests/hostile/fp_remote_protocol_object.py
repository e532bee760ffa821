# class: false_pass
# mode: asserts
# what: object with every dunder answering 'yes'
class Yes:
    def __eq__(s, o): return True
    def __bool__(s): return True
    def __len__(s): return 1
    def __iter__(s): return iter([3])
    def __getitem__(s, k): return 3
    def __index__(s): return 3
    def __int__(s): return 3
    def __hash__(s): return 3
def add(a, b):
    return Yes()
