"""A cached loop's library linked without parsing its linking bitcode (read by cache_stamp's cache).

numba keeps a cached loop as its object code plus the LLVM bitcode of its module "for linking": the copy a
later compile inlines when it compiles a function calling this loop. Loading the entry parses that bitcode at
once (LLVM's reader over every function of the loop and its callees) and walks it for the names it defines,
which the execution engine answers its symbol lookups from. A process that only runs cached loops (a batch
worker, a session's first run) never links one into a new compile, so here the bitcode is parsed at its first
use, and the defined names are read from the object code's ELF symbol table, the code that is actually loaded
(every name the bitcode defines is there too). Anything else (another object format, a numba whose cached
payload or library class differs) takes numba's own path.
"""

from __future__ import annotations

import struct

from numba.core import codegen, compiler

_ELF_SYMTAB = 2
_STT_SECTION, _STT_FILE = 3, 4


def defined_symbols(object_code: bytes) -> set[str] | None:
    """The names an ELF64 little-endian object defines (every symbol with a section, but section and file
    symbols), or None for another format."""
    if object_code[:4] != b"\x7fELF" or object_code[4:6] != b"\x02\x01":
        return None
    (section_headers,) = struct.unpack_from("<Q", object_code, 0x28)
    entry_size, count = struct.unpack_from("<HH", object_code, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", object_code, section_headers + i * entry_size)
                for i in range(count)]
    names: set[str] = set()
    for _, kind, _, _, offset, size, link, _, _, symbol_size in sections:
        if kind != _ELF_SYMTAB or symbol_size == 0:
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, symbol_size):
            name, info, _, section, _, _ = struct.unpack_from("<IBBHQQ", object_code, at)
            if section == 0 or name == 0 or info & 0xF in (_STT_SECTION, _STT_FILE):
                continue
            start = strings + name
            names.add(object_code[start:object_code.index(b"\0", start)].decode())
    return names


_lazy_classes: dict[type, type] = {}


def _lazy_linking_class(base: type) -> type:
    """``base`` (numba's JIT library class) whose module for linking is parsed from its bitcode at first use."""
    cls = _lazy_classes.get(base)
    if cls is None:
        def shared_module(self):
            state = self.__dict__
            if state.get("_linking_bitcode") is not None:
                from llvmlite import binding

                state["_linking_module"] = binding.parse_bitcode(state.pop("_linking_bitcode"))
            return state.get("_linking_module")

        def set_shared_module(self, module):
            self.__dict__.pop("_linking_bitcode", None)
            self.__dict__["_linking_module"] = module

        cls = type(f"Lazy{base.__name__}", (base,), {"_shared_module": property(shared_module, set_shared_module),
                                                      "__doc__": _lazy_linking_class.__doc__})
        _lazy_classes[base] = cls
    return cls


def _unserialize(code_generator, libdata):
    """numba's ``CPUCodeLibrary._unserialize`` for object code, the linking bitcode left unparsed; None where
    that does not apply (numba's own then runs)."""
    base = getattr(code_generator, "_library_class", None)
    engine = getattr(code_generator, "_engine", None)
    known = getattr(engine, "_defined_symbols", None)
    if (not isinstance(libdata, tuple) or len(libdata) != 3 or libdata[1] != "object" or base is None
            or not issubclass(base, codegen.JITCodeLibrary) or not isinstance(known, set)
            or base._unserialize.__func__ is not codegen.CPUCodeLibrary._unserialize.__func__):  # noqa: SLF001
        return None
    name, _, (object_code, linking_bitcode) = libdata
    symbols = defined_symbols(object_code)
    if symbols is None:
        return None
    library = _lazy_linking_class(base)(code_generator, name)
    library.enable_object_caching()
    library._set_compiled_object(object_code)  # noqa: SLF001  (as numba's _unserialize)
    library.__dict__["_linking_bitcode"] = linking_bitcode
    library._finalize_final_module()  # noqa: SLF001
    known |= symbols  # what numba's _load_defined_symbols reads from the parsed bitcode
    return library


def rebuild(target_context, payload):
    """numba's ``CompileResult._rebuild`` of a cached payload, its library by _unserialize where that applies."""
    if len(payload) != 9:  # numba's CompileResult._reduce layout
        return compiler.CompileResult._rebuild(target_context, *payload)  # noqa: SLF001
    libdata, fndesc, env, signature, objectmode, lifted, typeann, reload_init, referenced_envs = payload
    library = _unserialize(target_context.codegen(), libdata)
    if library is None:
        return compiler.CompileResult._rebuild(target_context, *payload)  # noqa: SLF001
    for initialize in reload_init or ():
        initialize()
    entry_point = target_context.get_executable(library, fndesc, env)
    result = compiler.CompileResult(
        target_context=target_context, typing_context=target_context.typing_context, library=library,
        environment=env, entry_point=entry_point, fndesc=fndesc, type_annotation=typeann, signature=signature,
        objectmode=objectmode, lifted=lifted, typing_error=None, call_helper=None, metadata=None,
        reload_init=reload_init, referenced_envs=referenced_envs)
    for referenced in referenced_envs:
        library.codegen.set_env(referenced.env_name, referenced)
    return result
