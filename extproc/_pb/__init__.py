"""Generated protobuf/gRPC modules for Envoy's ext_proc API (see proto/ and scripts/gen_proto.sh).

Do not edit: regenerate with `make proto`.
"""
