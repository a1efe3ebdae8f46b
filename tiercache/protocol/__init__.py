"""The wire protocol shared by client and server: the generated stubs (`tiercache._proto`, from
`proto/tiercache.proto`), message conversions, limits and the one error table. Imports `prefix`, `record`, `errors`."""
