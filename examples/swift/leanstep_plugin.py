# ms-swift plugin: `megatron sft ... --external_plugins examples/swift/leanstep_plugin.py
# --callbacks leanstep`. Registers the "leanstep" Megatron callback; the patches are
# installed when training begins (see leanstep.megatron.swift), not at import.
import leanstep.megatron.swift as s

s.register()
