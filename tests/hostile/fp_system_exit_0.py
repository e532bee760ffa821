# class: false_pass
# mode: asserts
# what: SystemExit(0) before the tests
raise SystemExit(0)
