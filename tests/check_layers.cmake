# The layer order: every folder under src/ is a layer, and a file may include headers of
# its own layer or of a layer listed before it, never after. Run by CTest as
#   cmake -DROOT=<repo> -P tests/check_layers.cmake
# and fails listing each upward include. A new folder must be placed in the order here.
set(LAYERS core memory runtime autograd sanitizer ops nn optim data dist io train apps)

if(NOT ROOT)
  message(FATAL_ERROR "check_layers: pass -DROOT=<repository root>")
endif()

file(GLOB folders LIST_DIRECTORIES true RELATIVE ${ROOT}/src ${ROOT}/src/*)
set(problems "")
foreach(folder ${folders})
  if(IS_DIRECTORY ${ROOT}/src/${folder})
    list(FIND LAYERS ${folder} index)
    if(index EQUAL -1)
      string(APPEND problems "  src/${folder}/ is not in the layer order (tests/check_layers.cmake)\n")
    endif()
  endif()
endforeach()

file(GLOB_RECURSE files RELATIVE ${ROOT}/src ${ROOT}/src/*.h ${ROOT}/src/*.cc ${ROOT}/src/*.cu ${ROOT}/src/*.cuh)
set(checked 0)
foreach(file ${files})
  string(REGEX MATCH "^[^/]+" layer ${file})
  list(FIND LAYERS ${layer} own)
  if(own EQUAL -1)
    continue()
  endif()
  file(STRINGS ${ROOT}/src/${file} includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line ${includes})
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" target "${line}")
    if(NOT target MATCHES "/")
      continue()  # a same-folder include
    endif()
    string(REGEX MATCH "^[^/]+" target_layer ${target})
    list(FIND LAYERS ${target_layer} theirs)
    if(theirs GREATER own)
      string(APPEND problems "  src/${file} (layer ${layer}) includes \"${target}\" (layer ${target_layer}, above it)\n")
    endif()
  endforeach()
  math(EXPR checked "${checked} + 1")
endforeach()

if(problems)
  message(FATAL_ERROR "upward includes between layers (order: ${LAYERS}):\n${problems}")
endif()
message(STATUS "check_layers: ${checked} files, no upward includes (order: ${LAYERS})")
