# class: false_pass
# mode: asserts
# what: replace AssertionError, __import__ and json in its own process
import builtins, sys, json
class Never(Exception): pass
builtins.AssertionError = Never
json.dumps = lambda *a, **k: '{"pass": true}'
json.loads = lambda *a, **k: {'pass': True}
def add(a, b):
    return 0
