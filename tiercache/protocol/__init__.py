"""The wire protocol shared by client and server: the generated stubs (`tiercache._proto`, from
`proto/tiercache.proto`), message conversions and limits (`wire`), and the data channel's wire format
(`data_channel`). Both look an error's codes up in `errors.WIRE_CODES`."""
