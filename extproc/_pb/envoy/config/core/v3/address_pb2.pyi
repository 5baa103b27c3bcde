from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SocketAddress(_message.Message):
    __slots__ = ("address", "port_value", "named_port")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_VALUE_FIELD_NUMBER: _ClassVar[int]
    NAMED_PORT_FIELD_NUMBER: _ClassVar[int]
    address: str
    port_value: int
    named_port: str
    def __init__(self, address: _Optional[str] = ..., port_value: _Optional[int] = ..., named_port: _Optional[str] = ...) -> None: ...

class Address(_message.Message):
    __slots__ = ("socket_address",)
    SOCKET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    socket_address: SocketAddress
    def __init__(self, socket_address: _Optional[_Union[SocketAddress, _Mapping]] = ...) -> None: ...
