"""The wire protocol shared by client and server: the generated stubs (`tiercache._proto`, from
`proto/tiercache.proto`), message conversions and limits (`wire`), the data channel's wire format
(`data_channel`) and the socket reads and sends both its ends use (`sockets`). `wire` and `data_channel` look an
error's codes up in `errors.WIRE_CODES`."""
